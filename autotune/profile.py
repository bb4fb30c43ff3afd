"""Per-machine, per-model profiles: typed, versioned JSON, written atomically, never fatal when broken.

A profile holds the machine and model fingerprints, the measurements and the chosen plan. It lives under
the user data directory (`TANDEM_HOME` overrides it, as tests do). A corrupt or old-schema file is moved
aside with a notice and the caller re-tunes; a profile made on other hardware is not used.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tandem.runtime.dispatch import Strategy
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.paths import atomic_write_json, data_dir, remove_stale_temporaries, set_aside

SCHEMA = 2  # raised whenever a saved plan would mean something else: a profile of another schema is set aside


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


STALE_TEMP_S = 600.0  # a profile save takes milliseconds: a temporary file this old was left by a killed one


def find_profile(machine: dict[str, Any], model: dict[str, Any]) -> Found:
    path = profile_path(machine, model)
    remove_stale_temporaries(path.parent, older_than_s=STALE_TEMP_S)
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
        return Found(profile_from_dict(data))
    except RecursionError:
        return Found(None, _set_aside(path, "it could not be read (it is nested too deeply)"))
    except (OSError, ValueError) as e:  # (json's and UTF-8's errors are ValueErrors)
        return Found(None, _set_aside(path, f"it could not be read ({e})"))


def profile_from_dict(data: dict[str, Any]) -> Profile:
    """Every field checked, the plan's too: a profile is applied at every start, so one bad value read
    unchecked would fail every start. Raises ValueError naming the first bad field."""
    names = {f.name for f in fields(Profile)}
    if set(data) - names:
        raise ValueError(f"unknown fields {sorted(set(data) - names)}")
    for name in ("machine", "model", "measurements", "plan", "predicted"):
        if not isinstance(data.get(name), dict):
            raise ValueError(f"'{name}' is {data.get(name)!r}, not a JSON object")
    if not isinstance(data.get("created", ""), str):
        raise ValueError(f"'created' is {data['created']!r}, not a text")
    check_plan(data["plan"])
    return Profile(**data)


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _one_of(value: Any, names: type[Strategy] | type[CachePolicy]) -> bool:
    return isinstance(value, str) and value in {n.value for n in names}


PLAN_FIELDS = {"threads", "accelerator", "strategy", "cache", "static_experts", "kernel", "quant", "static"}


def check_plan(plan: dict[str, Any]) -> None:
    """The plan as `Plan.to_dict` writes it (plus `static`, the experts kept on the accelerator)."""
    unknown = set(plan) - PLAN_FIELDS
    if unknown:
        raise ValueError(f"the plan has unknown fields {sorted(unknown)}")

    def bad(name: str, value: Any, what: str) -> ValueError:
        return ValueError(f"the plan's {name} is {value!r}, not {what}")

    if not _whole(plan.get("threads"), 1):
        raise bad("threads", plan.get("threads"), "a whole number ≥ 1")
    if not isinstance(plan.get("accelerator", False), bool):
        raise bad("accelerator", plan["accelerator"], "true or false")
    if not _one_of(plan.get("strategy", "cpu"), Strategy):
        raise bad("strategy", plan["strategy"], f"one of {', '.join(Strategy)}")
    if not _whole(plan.get("static_experts", 0), 0):
        raise bad("static_experts", plan["static_experts"], "a whole number ≥ 0")
    if plan.get("quant", "none") not in (None, "none", "int8", "int4", "mxfp4", "q8_0", "q4_k"):
        raise bad("quant", plan["quant"], "none, int8, int4, mxfp4, q8_0 or q4_k")
    cache = plan.get("cache", {})
    if not isinstance(cache, dict) or set(cache) - {"indexes", "ways", "policy"}:
        raise bad("cache", cache, "an object of indexes, ways and policy")
    for name in ("indexes", "ways"):
        if not _whole(cache.get(name, 0), 0):
            raise bad(f"cache {name}", cache[name], "a whole number ≥ 0")
    if not _one_of(cache.get("policy", "lru"), CachePolicy):
        raise bad("cache policy", cache["policy"], f"one of {', '.join(CachePolicy)}")
    kernel = plan.get("kernel", {})
    if not isinstance(kernel, dict) or set(kernel) - {"isa", "crossover"}:
        raise bad("kernel", kernel, "an object of isa and crossover")
    if not isinstance(kernel.get("isa"), str | None):
        raise bad("kernel isa", kernel["isa"], "a name")
    if kernel.get("crossover") is not None and not _whole(kernel["crossover"], 1):
        raise bad("kernel crossover", kernel["crossover"], "a whole number ≥ 1")
    static = plan.get("static", [])
    if not isinstance(static, list) or not all(
            isinstance(k, list) and len(k) == 2 and all(_whole(v, 0) for v in k) for k in static):
        raise bad("static", static, "a list of [layer, expert] pairs")


def _set_aside(path: Path, why: str) -> str:
    try:
        aside = set_aside(path, ".json")
    except OSError:
        return f"the profile {path} is unusable ({why}) and could not be moved aside; run `tandem autotune`"
    return f"the profile {path.name} was set aside as {aside.name} because {why}; run `tandem autotune` to re-tune"
