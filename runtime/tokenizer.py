"""Text <-> token ids, chat templates and streaming detokenisation.

Kept apart from the engine (which speaks only token ids). Uses the `tokenizers` library on the folder's
`tokenizer.json`; chat templates render in `runtime/chat_template.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tandem.kernels.errors import CheckpointError
from tandem.runtime.chat_template import render
from tandem.runtime.paths import read_bounded


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}; anything else is no token."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# The tokenizer files are read whole, so only regular files of a bounded size: a FIFO would block forever and a
# link to /dev/zero would fill memory. Real tokenizer.json files reach ~35 MB (262k-token vocabularies);
# tokenizer_config.json (with long lists of added tokens) and chat templates stay far below 16 MB.
TOKENIZER_MAX_BYTES = 128 << 20
CONFIG_MAX_BYTES = 16 << 20



class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None,
                 template_problem: str | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.template_problem = template_problem  # why the template file could not be read (said only if used)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer files into the folder")
        try:
            backend = HFTokenizer.from_str(read_bounded(path, TOKENIZER_MAX_BYTES).decode("utf-8"))
        except Exception as e:  # the tokenizers library raises plain Exception on malformed files
            raise CheckpointError(f"cannot read {path}: {e}; re-download the tokenizer files") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(read_bounded(config_path, CONFIG_MAX_BYTES).decode("utf-8"))
            except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, or not JSON
                raise CheckpointError(f"cannot read {config_path}: {e}; re-download the tokenizer files") from None
            if not isinstance(config, dict):
                raise CheckpointError(f"{config_path} does not hold a JSON object; re-download the tokenizer files")
        return cls(backend, config, *_chat_template(folder, config))

    @classmethod
    def from_model(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model folder, or of a GGUF file (its own tokenizer metadata and chat template)."""
        from tandem.runtime.gguf import is_gguf

        path = Path(path)
        return cls.from_gguf(path) if path.is_file() and is_gguf(path) else cls.from_folder(path)

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """A GGUF file's tokenizer, as transformers converts llama.cpp's tokenizer metadata (BPE and
        SentencePiece vocabularies), with its special tokens and `tokenizer.chat_template`."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        from tandem.runtime.gguf import gguf_files
        from tandem.runtime.gguf_header import header_of

        first = gguf_files(path)[0]  # a split model keeps its metadata in the first part
        # checked first: transformers' reader trusts the file's counts and lengths, and the metadata's types
        problem = gguf_tokenizer_problem(header_of(first).meta)
        if problem:
            raise CheckpointError(f"{path}: {problem}; the file's tokenizer is damaged: download or convert it "
                                  "again")
        try:
            architecture, vocabulary, config = get_gguf_tokenizer(str(first))
            backend, _ = convert_gguf_tokenizer(architecture, vocabulary)
        except Exception as e:  # noqa: BLE001 - transformers' and tokenizers' errors (the latter's a bare Exception)
            raise CheckpointError(f"cannot read the tokenizer of {path}: {e!r}; the file's tokenizer metadata is "
                                  "missing or of a kind Tandem cannot read") from None
        template = config.get("chat_template")
        return cls(backend, config, template if isinstance(template, str) else None)

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template_problem:
            raise CheckpointError(self.template_problem)
        if not self.chat_template:
            raise CheckpointError(
                "this model has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "run without --chat, or add a template"
            )
        return render(self.chat_template, messages, add_generation_prompt, self.bos_token or "", self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat-formatted prompt ids; the template already holds the special tokens."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def gguf_tokenizer_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a GGUF file's tokenizer metadata (`gguf_header` values: arrays as GGUFArray), or None:
    each key of the type llama.cpp writes, the per-token arrays as long as the vocabulary, special ids inside it."""
    from gguf import GGUFValueType as V

    from tandem.runtime.gguf_header import GGUFArray

    ints = {int(t) for t in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)}
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(meta.get("tokenizer.ggml.model"), str):
        return "tokenizer.ggml.model is missing or not a text"
    if not (isinstance(tokens, GGUFArray) and tokens.item_type == int(V.STRING) and tokens.count > 0):
        return "tokenizer.ggml.tokens is missing or not a list of texts"
    arrays = {"tokenizer.ggml.token_type": (ints, tokens.count), "tokenizer.ggml.scores": ({int(V.FLOAT32)},
              tokens.count), "tokenizer.ggml.merges": ({int(V.STRING)}, None)}
    for key, (kinds, length) in arrays.items():
        value = meta.get(key)
        if value is not None and not (isinstance(value, GGUFArray) and value.item_type in kinds
                                      and (length is None or value.count == length)):
            what = f" of {length} items, one a token" if length is not None else ""
            return f"{key} is not a list of the type llama.cpp writes{what}"
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            return f"{key} is not a text"
    for key, value in meta.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if key.startswith("tokenizer.ggml.add_") and not isinstance(value, bool):
            return f"{key} is not true or false"
        if key.endswith("_token_id") and (isinstance(value, bool) or not isinstance(value, int)
                                          or not 0 <= value < tokens.count):
            return f"{key} is {value!r}, not a token of the {tokens.count}"
    return None


def _chat_template(folder: Path, config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The chat template, or why it cannot be used: said only when it is, as only --chat and the chat app need it."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        try:
            return read_bounded(jinja, CONFIG_MAX_BYTES).decode("utf-8"), None
        except (OSError, ValueError) as e:  # ValueError: not UTF-8
            return None, f"cannot read the chat template {jinja}: {e}; fix or remove the file"
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in template):
            return None, ("tokenizer_config.json has a malformed 'chat_template' list: each named template must be "
                          '{"name": text, "template": text}; fix the list, or run without --chat')
        return {t["name"]: t["template"] for t in template}.get("default"), None
    return (template if isinstance(template, str) else None), None


class StreamDecoder:
    """Turns a stream of token ids into text deltas, holding back bytes of an unfinished character."""

    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = not keep_special  # kept: the text shows special tokens (harmony's channel markers)
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are fully emitted
        self.read = 0  # ids[prefix:read] decode to text already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip_special)
        text = self.tokenizer.decode(self.ids[self.prefix :], self.skip_special)
        if len(text) > len(before) and not text.endswith("\ufffd"):
            delta = text[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip_special)
        text = self.tokenizer.decode(self.ids[self.prefix :], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]
