"""The chat app on a model served elsewhere: any OpenAI-compatible server (vLLM, SGLang, llama-server, Ollama,
another `tandem serve`), through its `/v1/models` and streamed `/v1/chat/completions`.

`RemoteBackend` is a `ChatBackend`: the chat streams, saves and exports as it does on the local runtime. What only
the local runtime knows (expert activity, accelerator memory, tuning) it answers with None, and the app says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from tandem.app.chat.backend import TuningTarget, Usage
from tandem.app.serve.openai_api import sse_payloads
from tandem.kernels.errors import TandemError
from tandem.runtime.discover import ModelEntry
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams

CONNECT_S, READ_S = 10.0, 600.0  # a server may take minutes to start answering a long prompt, not to connect
CHARS_PER_TOKEN = 4  # the prompt's size in tokens, estimated (the server's tokenizer is not here): OpenAI's rule
MESSAGE_TOKENS = 4  # a message's role and template markers


def base_url(url: str) -> str:
    """The API's root: `http://host:port/v1` for a URL without a path, the URL as given otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TandemError(f"--remote {url!r} is not an http(s) URL; give one like http://127.0.0.1:8080/v1")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


class RemoteServer:
    """One OpenAI-compatible server: its models, and requests to it with the key."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers,
                                   timeout=httpx.Timeout(READ_S, connect=CONNECT_S))

    @property
    def host(self) -> str:
        return urlsplit(self.url).netloc

    def models(self) -> list[dict[str, Any]]:
        """The server's model cards (`id`, and what else it tells: `owned_by`, a context length)."""
        data = self._json(self._send("GET", "/models"))
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
            raise TandemError(f"{self.url}/models did not list models as an OpenAI-compatible server does")
        return cards

    def entries(self) -> list[ModelEntry]:
        """The picker's rows: the server's models (their size and shape are the server's business)."""
        return [ModelEntry(c["id"], c["id"], str(c.get("owned_by") or "remote"), 0, 0, 0, f"server {self.host}")
                for c in self.models()]

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise TandemError(f"cannot reach {self.url} ({e}); is the server running?") from None
        self.check(response)
        return response

    def check(self, response: httpx.Response) -> None:
        """A response with an error status -> the server's message, as an error that says what to do."""
        if response.status_code < 400:
            return
        response.read()
        message = response.text[:300]
        try:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                message = str(body["error"].get("message", message))
            elif isinstance(body, dict) and isinstance(body.get("error"), str):  # (Ollama's shape)
                message = body["error"]
        except ValueError:
            pass
        hint = " (give the server's key with --api-key)" if response.status_code in (401, 403) else ""
        raise TandemError(f"{self.url} answered {response.status_code}: {message}{hint}")

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise TandemError(f"{self.url} answered with something that is not JSON") from None

    def close(self) -> None:
        self.client.close()


def context_of(card: dict[str, Any]) -> int:
    """A model card's context length, under the names servers use for it; 0 when it gives none."""
    meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
    for value in (card.get("context_length"), card.get("max_model_len"), meta.get("n_ctx"),
                  meta.get("n_ctx_train")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


class RemoteBackend:
    """A model on a server, as the chat app sees a model."""

    def __init__(self, server: RemoteServer, model: str | None = None) -> None:
        cards = server.models()
        if not cards:
            raise TandemError(f"{server.url} serves no models")
        card = cards[0] if model is None else next((c for c in cards if c["id"] == model), None)
        if card is None:
            raise TandemError(f"{server.url} does not serve {model!r}; it serves "
                              f"{', '.join(c['id'] for c in cards[:10])}")
        self.server = server
        self.name = card["id"]
        self.family = str(card.get("owned_by") or "remote")
        self.placement = f"remote: {server.host}"
        self.remote: str | None = server.url
        self._context = context_of(card)
        self._usage = Usage(0.0, 0.0, None, 0, self._context)

    def stream(self, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]:
        """The answer's text as the server streams it. Stopping early (the generator closed) closes the
        connection, which stops a server's generation (tandem serve's, vLLM's, llama-server's)."""
        body: dict[str, Any] = {"model": self.name, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True}, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        # beyond OpenAI's own settings: sent only when they do something (a strict server refuses unknown fields)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if params.seed is not None:
            body["seed"] = params.seed
        start = time.perf_counter()
        first = last = 0.0
        pieces, usage = 0, None
        try:
            with self.server.client.stream("POST", "/chat/completions", json=body) as response:
                self.server.check(response)
                for data in sse_payloads(response.iter_lines()):
                    chunk = self._chunk(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            last = time.perf_counter()
                            first = first or last
                            pieces += 1
                            yield text
        except httpx.HTTPError as e:
            raise TandemError(f"the connection to {self.server.url} failed ({e})") from None
        finally:
            self._usage = self._measured(start, first, last, pieces, usage, messages)

    def _chunk(self, data: str) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise TandemError(f"{self.server.url} streamed something that is not JSON: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise TandemError(f"{self.server.url} streamed something that is not an answer: {data[:80]!r}")
        if chunk.get("error"):
            error = chunk["error"]
            raise TandemError(f"{self.server.url}: {error.get('message', error) if isinstance(error, dict) else error}")
        return chunk

    def _measured(self, start: float, first: float, last: float, pieces: int, usage: dict[str, Any] | None,
                  messages: list[dict[str, str]]) -> Usage:
        """Speed as seen from here (the network included): tokens after the first over the time they took, the
        server's own count when it gives one, else one a streamed piece."""
        tokens = usage.get("completion_tokens", pieces) if isinstance(usage, dict) else pieces
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
        used = (prompt if isinstance(prompt, int) else self.prompt_tokens(messages)) + tokens
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(rate, first - start if first else 0.0, None, used, self._context,
                     cached if isinstance(cached, int) and not isinstance(cached, bool) else 0)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """An estimate: the server's tokenizer is not here."""
        return sum(len(m["content"]) // CHARS_PER_TOKEN + MESSAGE_TOKENS for m in messages)

    @property
    def context(self) -> int:
        """The server's context length; 0 when it does not say (the chat then sends the whole conversation and the
        server says if it is too long)."""
        return self._context

    def usage(self) -> Usage:
        return self._usage

    def activity(self) -> list[list[int]]:
        return []

    def where(self) -> list[list[str]] | None:
        return None

    def vram(self) -> tuple[int, int] | None:
        return None

    def tuning_target(self) -> TuningTarget | None:
        return None

    def loaded_model(self) -> LoadedModel | None:
        return None

    def close(self) -> None:
        """The connection stays: the next model of the same server uses it."""
