"""Text <-> token ids, chat templates and streaming detokenisation.

Kept apart from the engine (which speaks only token ids). Uses the `tokenizers` library on the folder's
`tokenizer.json` and renders chat templates with a sandboxed Jinja2 environment, as transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from runtime.errors import CheckpointError


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer files into the folder")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception on malformed files
            raise CheckpointError(f"cannot read {path}: {e}; re-download the tokenizer files") from None
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            try:
                config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"cannot read {folder / 'tokenizer_config.json'}: {e}") from None
        return cls(backend, config, _chat_template(folder, config))

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError(
                "this model has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "run without --chat, or add a template"
            )
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise CheckpointError(f"the model's chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat-formatted prompt ids; the template already holds the special tokens."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


class StreamDecoder:
    """Turns a stream of token ids into text deltas, holding back bytes of an unfinished character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are fully emitted
        self.read = 0  # ids[prefix:read] decode to text already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            delta = text[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]
