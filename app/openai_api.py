"""OpenAI's completion requests and responses, as `tandem batch` and `tandem serve` read and write them.

A request body (`/v1/chat/completions` with `messages`, `/v1/completions` with `prompt`) becomes token ids, sampling
settings and stop sequences (`parse_body`); an answer's text grows token by token and is cut at the first stop
sequence (`Answer`); responses and stream chunks are OpenAI's shapes (`completion_body`, `chunk_body`). Nothing here
knows of files, HTTP or threads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_STOPS = 4  # as OpenAI
# body fields that would change what the answer means: refused rather than ignored
UNSUPPORTED = {"n": "more than one choice a request", "tools": "tools", "functions": "functions",
               "response_format": "response formats", "logprobs": "log probabilities", "logit_bias": "logit biases"}
HARMLESS = (None, False, 1, [], {}, {"type": "text"})  # those fields' values that ask for nothing more
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # engine reason -> OpenAI name


@dataclass(frozen=True)
class Parsed:
    """A request body, read: the prompt's token ids, how to sample, where to stop."""

    ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"body.{name} must be a {'number' if kind is float else 'whole number'}, not "
                         f"{json.dumps(value)[:40]}")
    return kind(value)


def messages_of(value: Any) -> list[dict[str, str]]:
    """Chat messages as the chat template takes them; a content given as parts keeps its text parts."""
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"body.messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts can be read")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"body.messages[{i}].content must be text")
        out.append({"role": m["role"], "content": content})
    return out


def parse_body(endpoint: str, body: dict[str, Any], tokenizer: Tokenizer, defaults: SamplingParams) -> Parsed:
    """A request body of `endpoint` (CHAT or COMPLETION) -> its prompt and settings, with `defaults` where it gives
    none. A body that cannot run raises ValueError (or the GenerationError of a setting out of range, the TandemError
    of a chat template that fails) with the reason."""
    for name, what in UNSUPPORTED.items():
        value = body.get(name)
        if value not in HARMLESS:
            raise ValueError(f"body.{name}: Tandem does not offer {what}")
    if endpoint == CHAT:
        ids = tokenizer.encode_chat(messages_of(body.get("messages")))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)  # token ids, as the completions API allows
        elif isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            raise ValueError("body.prompt must be text or a list of token ids (one prompt a request)")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    if stop is not None and (not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS):
        raise ValueError(f"body.stop must be a text or a list of up to {MAX_STOPS} non-empty texts")
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    params = SamplingParams(
        max_new_tokens=_number({"max_tokens": most}, "max_tokens", int, defaults.max_new_tokens),
        temperature=_number(body, "temperature", float, defaults.temperature),
        top_k=_number(body, "top_k", int, defaults.top_k),
        top_p=_number(body, "top_p", float, defaults.top_p),
        repetition_penalty=_number(body, "repetition_penalty", float, defaults.repetition_penalty),
        seed=_number(body, "seed", int, defaults.seed),
    )
    params.check()
    if params.seed is not None and not 0 <= params.seed < 2**63:
        raise ValueError("body.seed must be from 0 to 2^63 - 1")
    return Parsed(ids, params, stops)


@dataclass
class Answer:
    """A request's text as it streams, cut at the first stop sequence."""

    stops: tuple[str, ...]
    text: str = ""
    stopped: bool = False
    tokens: int = 0
    started: float = field(default_factory=time.time)
    sent: int = 0  # characters of text already streamed (`unsent`)

    def add(self, delta: str, token: bool = True) -> bool:
        """Append a token's text (or, `token` False, text held back until the end); True when a stop sequence has
        just appeared (the text is cut before it)."""
        if self.stopped:
            return False
        self.tokens += token
        tail = len(self.text)
        self.text += delta
        for s in self.stops:
            at = self.text.find(s, max(0, tail - len(s) + 1))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True
                return True
        return False

    def unsent(self, final: bool = False) -> str:
        """The text to stream now: all of it once `final` or stopped, else all but a tail that could still turn out
        to begin a stop sequence (streamed text cannot be taken back)."""
        hold = 0 if final or self.stopped else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


def finish_reason(answer: Answer, reason: str) -> str:
    """OpenAI's finish_reason for an engine's reason ("eos", "length", "context", "stop")."""
    return "stop" if answer.stopped else FINISH.get(reason, reason)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(endpoint: str, rid: str, created: int, model: str, text: str, reason: str,
                    usage: dict[str, int]) -> dict[str, Any]:
    """A whole answer: a `chat.completion` or a `text_completion`."""
    chat = endpoint == CHAT
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


def chunk_body(endpoint: str, rid: str, created: int, model: str, text: str | None, reason: str | None = None,
               usage: dict[str, int] | None = None, first: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed answer: a delta of text, the finish reason, or (`text` None, no choices)
    the usage that `stream_options.include_usage` asks for at the end."""
    chat = endpoint == CHAT
    choices: list[dict[str, Any]] = []
    if text is not None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        choices.append(choice)
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def sse_payloads(lines: Iterable[str]) -> Iterator[str]:
    """The data of a stream's server-sent events (a streamed answer's lines), up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data
