"""Per-machine, per-model profiles: typed, versioned JSON, written atomically, never fatal when broken.

A profile holds the machine and model fingerprints, the measurements and the chosen plan. It lives under
the user data directory (`TANDEM_HOME` overrides it, as tests do). A corrupt or old-schema file is moved
aside with a notice and the caller re-tunes; a profile made on other hardware is not used.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.paths import atomic_write_json, data_dir

SCHEMA = 2  # 2: the kernel variant is "auto" unless one beats it at 1 and 8 tokens (1 forced the fastest at 1)


def profiles_dir() -> Path:
    return data_dir() / "profiles"


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def model_fingerprint(raw_config: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {"model_type": raw_config.get("model_type"), "config_sha256": _digest(raw_config), "dtype": dtype}


@dataclass
class Profile:
    machine: dict[str, Any]
    model: dict[str, Any]
    measurements: dict[str, Any]
    plan: dict[str, Any]
    predicted: dict[str, Any]
    created: str = ""
    schema: int = SCHEMA

    @property
    def path(self) -> Path:
        return profile_path(self.machine, self.model)


def profile_path(machine: dict[str, Any], model: dict[str, Any]) -> Path:
    return profiles_dir() / f"{_digest(machine)}-{_digest(model)}.json"


def save_profile(profile: Profile) -> Path:
    """Write atomically: a temporary file in the same folder, then rename over the old one."""
    profile.created = profile.created or time.strftime("%Y-%m-%dT%H:%M:%S")
    return atomic_write_json(profile.path, asdict(profile))


@dataclass
class Found:
    profile: Profile | None
    notice: str | None = None  # something the user should be told (set aside, hardware changed, none yet)


def find_profile(machine: dict[str, Any], model: dict[str, Any]) -> Found:
    path = profile_path(machine, model)
    if path.exists():
        return _read(path)
    others = [p for p in profiles_dir().glob(f"*-{_digest(model)}.json")] if profiles_dir().is_dir() else []
    if others:
        return Found(None, "the hardware changed since this model was tuned; run `tandem autotune` to re-tune")
    return Found(None, None)


def _read(path: Path) -> Found:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return Found(None, _set_aside(path, f"it has schema {data.get('schema') if isinstance(data, dict) else '?'}"
                                                f", this Tandem writes {SCHEMA}"))
        return Found(Profile(**data))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        return Found(None, _set_aside(path, f"it could not be read ({e})"))


def _set_aside(path: Path, why: str) -> str:
    aside = path.with_name(f"{path.stem}.bad-{int(time.time())}.json")
    try:
        path.rename(aside)
    except OSError:
        return f"the profile {path} is unusable ({why}) and could not be moved aside; run `tandem autotune`"
    return f"the profile {path.name} was set aside as {aside.name} because {why}; run `tandem autotune` to re-tune"
