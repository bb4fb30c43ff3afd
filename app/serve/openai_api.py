"""OpenAI's completion requests and responses, as `tandem batch` and `tandem serve` read and write them.

A request body (`/v1/chat/completions` with `messages`, `/v1/completions` with `prompt`) becomes token ids, sampling
settings and stop sequences (`parse_body`); an answer's text grows token by token and is cut at the first stop
sequence (`Answer`); responses and stream chunks are OpenAI's shapes (`completion_body`, `chunk_body`). Nothing here
knows of files, HTTP or threads.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.kernels.errors import GenerationError
from tandem.runtime.sampling import SamplingParams

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_STOPS = 4  # as OpenAI
STOP_MOST = 1024  # characters of one stop sequence: each token's text is held back while it may start one
TEMPERATURE_MOST = 2.0  # as OpenAI
# body fields that would change what the answer means: refused rather than ignored; each with the values that ask
# for nothing more than a plain answer
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "n": ("more than one choice a request", (1,)),
    "best_of": ("more than one candidate a request", (1,)),
    "logprobs": ("log probabilities", (False,)),
    "top_logprobs": ("log probabilities", (0,)),
    "echo": ("echoing the prompt", (False,)),
    "suffix": ("a suffix after the answer", ("",)),
    "tools": ("tools", ([],)),
    "functions": ("functions", ([],)),
    "tool_choice": ("tools", ("none", "auto")),
    "function_call": ("functions", ("none", "auto")),
    "logit_bias": ("logit biases", ({},)),
    "presence_penalty": ("a presence penalty (repetition_penalty is offered)", (0,)),
    "frequency_penalty": ("a frequency penalty (repetition_penalty is offered)", (0,)),
}
# the fields read (or checked: UNSUPPORTED's, response_format) besides each endpoint's prompt; one of OpenAI's that
# changes nothing in the answer is taken and ignored; any other field is refused by name, as OpenAI refuses what it
# does not know: a misspelt `max_token` or a server-specific knob would otherwise pass unnoticed
READ = {"model", "stream", "stream_options", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_k",
        "top_p", "repetition_penalty", "seed", "response_format", *UNSUPPORTED}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier"}
PROMPT_FIELD = {CHAT: "messages", COMPLETION: "prompt"}
ROLES = ("system", "developer", "user", "assistant")  # those a chat template places; tool results need tools
MESSAGE_FIELDS = ("role", "content", "name")  # a message's: `name` (a participant's) is read and not used
RESPONSE_FORMATS = ("text",)  # response_format types answered: plain text, no JSON mode or schema
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # engine reason -> OpenAI name


class BodyError(ValueError):
    """A request body that cannot run: `param` names the field at fault (None: the body as a whole), `code` is
    OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class PromptEncoder(Protocol):
    """What turns a prompt into token ids: a Tokenizer, or a stand-in that bounds the work or where it runs."""

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Parsed:
    """A request body, read: the prompt's token ids, how to sample, where to stop."""

    ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


def shown(value: Any) -> str:
    """A value for an error message: short, and without walking a container (one can nest a thousand deep)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str) and len(value) > 40:
        value = value[:40] + "..."
    return json.dumps(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _harmless(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` asks for nothing more: absent, or one of `allowed` of the same kind (true is not 1, 0 not false)."""
    if value is None:
        return True
    return any((_is_number(value) and _is_number(a) or type(value) is type(a)) and value == a for a in allowed)


def _number(body: dict[str, Any], name: str, kind: type, default: Any, param: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not isinstance(value, int) and (kind is int or not math.isfinite(value)):
        raise BodyError(f"body.{param or name} must be a {'number' if kind is float else 'whole number'}, not "
                        f"{shown(value)}", param or name)
    try:
        return kind(value)
    except OverflowError:  # a whole number of hundreds of digits where a float goes
        raise BodyError(f"body.{param or name} is far out of range ({shown(value)[:20]}...)", param or name) from None


def text_of(value: str, param: str) -> str:
    """`value`, which must encode as UTF-8: JSON's escapes can spell a lone surrogate (\\ud800), which no text is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(f"body.{param} holds a lone UTF-16 surrogate ({shown(value[e.start:e.end])}) at character "
                        f"{e.start}: it is not text; send valid Unicode", param) from None
    return value


def messages_of(value: Any) -> list[dict[str, str]]:
    """Chat messages as the chat template takes them; a content given as parts keeps its text parts."""
    if not isinstance(value, list) or not value:
        raise BodyError("body.messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BodyError(f"body.{at} must be an object {{role, content}}, not {shown(m)}", at)
        unknown = next((k for k in m if k not in MESSAGE_FIELDS), None)
        if unknown is not None:  # tool calls and results, audio...: not offered; a misspelt field: said
            name = json.dumps(unknown[:40])[1:-1]
            raise BodyError(f"body.{at}.{name}: unrecognized field; a message holds {', '.join(MESSAGE_FIELDS)}",
                            f"{at}.{name}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise BodyError(f"body.{at}.name must be a text, not {shown(m['name'])}", f"{at}.name")
        role = text_of(m["role"], f"{at}.role") if isinstance(m.get("role"), str) else m.get("role")
        if role not in ROLES:
            raise BodyError(f"body.{at}.role must be one of {', '.join(ROLES)}, not {shown(role)}", f"{at}.role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BodyError(f"body.{at}.content: only text parts can be read", f"{at}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BodyError(f"body.{at}.content must be text or a list of text parts", f"{at}.content")
        out.append({"role": role, "content": text_of(content, f"{at}.content")})
    return out


def stops_of(value: Any) -> tuple[str, ...]:
    """`stop`: absent, a text, or a list of up to MAX_STOPS non-empty texts."""
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list) else None
    if stops is None or len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= STOP_MOST
                                                          for s in stops):
        raise BodyError(f"body.stop must be a text or a list of up to {MAX_STOPS} non-empty texts of at most "
                        f"{STOP_MOST} characters, not {shown(value)}", "stop")
    return tuple(text_of(s, "stop") for s in stops)


def check_options(endpoint: str, body: dict[str, Any]) -> None:
    """Refuse what Tandem does not offer (a BodyError naming the field): a field it does not know, more choices, log
    probabilities, tools, a response format other than text, and the rest of UNSUPPORTED; and a `stream` or `user`
    of the wrong kind."""
    known = READ | IGNORED | {PROMPT_FIELD[endpoint]}
    unknown = next((name for name in body if name not in known), None)
    if unknown is not None:
        name = json.dumps(unknown[:40])[1:-1]  # (control characters escaped: a hostile name stays one line)
        hint = next((f" ({e} takes it)" for e, f in PROMPT_FIELD.items() if f == unknown), "")
        raise BodyError(f"body.{name}: unrecognized field{hint}; {endpoint} reads "
                        f"{', '.join(sorted(known - IGNORED))}", name)
    for name, (what, allowed) in UNSUPPORTED.items():
        if not _harmless(body.get(name), allowed):
            raise BodyError(f"body.{name}: Tandem does not offer {what}; leave {name} out (it is "
                            f"{shown(body[name])})", name)
    form = body.get("response_format")
    if form is not None:
        kind = form.get("type") if isinstance(form, dict) else None
        if kind not in RESPONSE_FORMATS:
            raise BodyError(f"body.response_format: Tandem does not offer response formats other than "
                            f'{{"type": "text"}} (asked: {shown(kind if isinstance(kind, str) else form)})',
                            "response_format")
    for name, kinds, what in (("stream", bool, "true or false"), ("user", str, "a text"),
                              ("stream_options", dict, "an object")):
        if body.get(name) is not None and not isinstance(body[name], kinds):
            raise BodyError(f"body.{name} must be {what}, not {shown(body[name])}", name)
    usage = (body.get("stream_options") or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise BodyError(f"body.stream_options.include_usage must be true or false, not {shown(usage)}",
                        "stream_options.include_usage")


def params_of(body: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The sampling settings a body asks for, `defaults` where it gives none; one out of range is a BodyError."""
    most = defaults.max_new_tokens
    for name in ("max_tokens", "max_completion_tokens"):  # (max_completion_tokens wins: OpenAI's newer name)
        most = _number(body, name, int, most)
        if body.get(name) is not None and most < 1:
            raise BodyError(f"body.{name} must be a whole number of at least 1, not {most}", name)
    params = SamplingParams(
        max_new_tokens=most,
        temperature=_number(body, "temperature", float, defaults.temperature),
        top_k=_number(body, "top_k", int, defaults.top_k),
        top_p=_number(body, "top_p", float, defaults.top_p),
        repetition_penalty=_number(body, "repetition_penalty", float, defaults.repetition_penalty),
        seed=_number(body, "seed", int, defaults.seed),
    )
    for name, bad, rule in (
            ("temperature", not 0 <= params.temperature <= TEMPERATURE_MOST,
             f"from 0 to {TEMPERATURE_MOST:g} (0 is greedy)"),
            ("top_p", not 0 < params.top_p <= 1, "above 0 and at most 1"),
            ("top_k", params.top_k < 0, "0 (off) or more"),
            ("repetition_penalty", params.repetition_penalty <= 0, "above 0 (1 is off)"),
            ("seed", params.seed is not None and not 0 <= params.seed < 2**63, "from 0 to 2^63 - 1")):
        if bad and body.get(name) is not None:
            raise BodyError(f"body.{name} must be {rule}, not {shown(body[name])}", name)
    try:
        params.check()  # (a default out of range: the command line's, said as it says it)
    except GenerationError as e:
        raise BodyError(str(e)) from None
    return params


def parse_body(endpoint: str, body: dict[str, Any], tokenizer: PromptEncoder, defaults: SamplingParams) -> Parsed:
    """A request body of `endpoint` (CHAT or COMPLETION) -> its prompt and settings, with `defaults` where it gives
    none. A body that cannot run raises BodyError (a ValueError naming the field; or the TandemError of a chat
    template that fails) with the reason. Everything is checked before the prompt is tokenized."""
    check_options(endpoint, body)
    stops = stops_of(body.get("stop"))
    params = params_of(body, defaults)
    if endpoint == CHAT:
        messages = messages_of(body.get("messages"))
        ids = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)  # (the template has them)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = list(prompt)  # token ids, as the completions API allows
        elif isinstance(prompt, str):
            ids = tokenizer.encode(text_of(prompt, "prompt"))
        else:
            raise BodyError("body.prompt must be text or a list of token ids (one prompt a request)", "prompt")
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


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: the prompt's, held by a KV cache row already (prefix reuse)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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
