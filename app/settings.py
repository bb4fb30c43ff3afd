"""Generation settings the user picks in the app (F2), saved as versioned JSON beside the conversations."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields

from runtime.errors import GenerationError
from runtime.paths import atomic_write_json, data_dir
from runtime.sampling import SamplingParams

SCHEMA = 1


@dataclass
class Settings:
    system_prompt: str = ""
    temperature: float = 0.2  # small local models answer best close to greedy
    top_p: float = 0.9
    top_k: int = 0
    max_new_tokens: int = 512
    repetition_penalty: float = 1.0
    schema: int = SCHEMA

    def params(self) -> SamplingParams:
        p = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                           top_p=self.top_p, repetition_penalty=self.repetition_penalty)
        p.check()
        return p

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> Settings:
        """From the form's text fields; raises GenerationError saying which value is wrong."""
        out = cls()
        for f in fields(cls):
            if f.name not in values or f.name == "schema":
                continue
            kind = type(getattr(out, f.name))
            try:
                setattr(out, f.name, kind(values[f.name]) if kind is not str else values[f.name])
            except ValueError:
                raise GenerationError(f"{f.name.replace('_', ' ')}: {values[f.name]!r} is not a number") from None
        out.params()
        return out


def settings_path():
    return data_dir() / "settings.json"


def load_settings() -> tuple[Settings, str | None]:
    """The saved settings (defaults if none); a broken file is set aside and reported."""
    path = settings_path()
    if not path.exists():
        return Settings(), None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')}")
        s = Settings(**data)
        s.params()
        return s, None
    except (OSError, ValueError, TypeError, AttributeError, GenerationError) as e:
        aside = path.with_name(f"settings.bad-{int(time.time())}.json.txt")
        path.rename(aside)
        return Settings(), f"the settings file could not be used ({e}); it was set aside as {aside.name}"


def save_settings(s: Settings) -> None:
    atomic_write_json(settings_path(), asdict(s))
