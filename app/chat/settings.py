"""Generation settings the user picks in the app (F2), saved as versioned JSON beside the conversations.

Every field is checked for its type and range, whether it comes from the form or from the file: a file that
fails is set aside with a notice (defaults are used), the form shows what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tandem.kernels.errors import GenerationError, SettingsError
from tandem.runtime.paths import atomic_write_json, data_dir, read_saved
from tandem.runtime.sampling import SamplingParams

SCHEMA = 1
# the fields the settings form shows, in its order (after the system prompt, which has a box of its own)
FORM_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty")
GENERATION_FIELDS = ("system_prompt", *FORM_FIELDS)  # what a conversation keeps of them


@dataclass
class Settings:
    system_prompt: str = ""
    temperature: float = 0.2  # small local models answer best close to greedy
    top_p: float = 0.9
    top_k: int = 0
    max_new_tokens: int = 512
    repetition_penalty: float = 1.0
    # the app's colours, as last chosen (Ctrl+P, "theme"): the app's own, never a conversation's (not compared, not
    # saved with a chat)
    theme: str = field(default="textual-dark", compare=False)
    schema: int = SCHEMA

    def params(self) -> SamplingParams:
        """The sampling parameters; raises SettingsError saying which value is wrong."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), type(getattr(Settings, f.name)))
        if self.max_new_tokens < 1:
            raise SettingsError(f"max new tokens: {self.max_new_tokens} is too few (an answer needs at least 1)")
        p = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                           top_p=self.top_p, repetition_penalty=self.repetition_penalty)
        try:
            p.check()
        except GenerationError as e:
            raise SettingsError(str(e)) from None
        return p

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> Settings:
        """From the form's text fields; raises SettingsError saying which value is wrong."""
        out = cls()
        for f in fields(cls):
            if f.name not in values or f.name == "schema":
                continue
            kind, text = type(getattr(out, f.name)), values[f.name]
            label = f.name.replace("_", " ")
            try:
                setattr(out, f.name, kind(text.strip()) if kind is not str else text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise SettingsError(f"{label}: {text!r} is not {what}") from None
        out.params()
        return out


def _check_type(name: str, value: Any, kind: type) -> None:
    """`kind` as saved: a float field takes any number (JSON writes 1.0 as 1), never a boolean or a text."""
    label = name.replace("_", " ")
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise SettingsError(f"{label}: {value} is not a finite number")
    if not ok:
        what = {str: "a text", int: "a whole number", float: "a number"}[kind]
        raise SettingsError(f"{label}: {value!r} is not {what}")


def settings_from_dict(data: Any) -> Settings:
    """Settings read from the file; a field it lacks keeps its default. Raises SettingsError or ValueError."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    if data.get("schema") != SCHEMA or isinstance(data.get("schema"), bool):
        raise ValueError(f"schema {data.get('schema')!r}, this Tandem reads {SCHEMA}")
    unknown = set(data) - {f.name for f in fields(Settings)}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    s = Settings(**data)
    s.params()
    return s


def settings_path() -> Path:
    return data_dir() / "settings.json"


def load_settings() -> tuple[Settings, str | None]:
    """The saved settings (defaults if none); a broken file is set aside and reported."""
    return read_saved(settings_path(), settings_from_dict, Settings(), "settings file", "the defaults apply")


def save_settings(s: Settings) -> None:
    """Raises OSError when the file cannot be written."""
    atomic_write_json(settings_path(), asdict(s))
