"""Per-machine, per-model profiles: typed, versioned JSON, written atomically, never fatal when broken.

A profile holds the machine and model fingerprints, the measurements and the chosen plan. It lives under
the user data directory (`TANDEM_HOME` overrides it, as tests do). A corrupt or old-schema file is moved
aside with a notice and the caller re-tunes; a profile made on other hardware is not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tandem.autotune.measurements import MAX_COUNT, Measurements
from tandem.kernels.errors import TandemError
from tandem.runtime.choices import PredictorKind
from tandem.runtime.dispatch import Strategy
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.paths import (
    SAVED_MAX_BYTES,
    atomic_write_json,
    data_dir,
    read_json,
    remove_stale_temporaries,
    set_aside,
)
from tandem.runtime.prefetch import MAX_DEPTH

SCHEMA = 2  # raised whenever a saved plan would mean something else: a profile of another schema is set aside


def profiles_dir() -> Path:
    return data_dir() / "profiles"


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def collection_path(raw_config: dict[str, Any]) -> Path:
    """Where the EAM prefetch predictor keeps a model's activation collection (runtime/prefetch.py), beside the
    profiles: one per model whatever the machine or dtype (routing does not depend on them)."""
    return profiles_dir() / f"eam-{_digest(model_fingerprint(raw_config, ''))}.npz"


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
    """This machine's profile for the model. Never raises, never blocks: a file that cannot be used is set aside
    and the notice says so (the caller runs with defaults)."""
    path = profile_path(machine, model)
    remove_stale_temporaries(path.parent, older_than_s=STALE_TEMP_S)
    # lexists, not exists: a dangling link or a link loop is no profile either, and is set aside like one
    if os.path.lexists(path):
        return _read(path, machine)
    others = [p for p in profiles_dir().glob(f"*-{_digest(model)}.json")] if profiles_dir().is_dir() else []
    if others:
        return Found(None, "the hardware changed since this model was tuned; run `tandem autotune` to re-tune")
    return Found(None, None)


def _read(path: Path, machine: dict[str, Any]) -> Found:
    """Only a regular file of bounded size and nesting is read (`read_json`): a FIFO there would block every start,
    a link to /dev/zero fill the RAM. Anything that cannot be used is set aside, never raised."""
    try:
        data = read_json(path, SAVED_MAX_BYTES)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return Found(None, _set_aside(path, f"it has schema {data.get('schema') if isinstance(data, dict) else '?'}"
                                                f", this Tandem writes {SCHEMA}"))
        profile = profile_from_dict(data)
        check_threads(profile.plan, machine)
        return Found(profile)
    except RecursionError:
        return Found(None, _set_aside(path, "it could not be read (it is nested too deeply)"))
    except OSError as e:  # (its reason alone: the path is in the notice)
        return Found(None, _set_aside(path, f"it could not be read ({e.strerror or e})"))
    except (ValueError, TandemError) as e:  # (json's and UTF-8's errors are ValueErrors)
        return Found(None, _set_aside(path, f"it could not be read ({e})"))


def check_threads(plan: dict[str, Any], machine: dict[str, Any]) -> None:
    """A plan's threads within the machine's: the tuner only picks counts it measured here, and loading refuses
    more threads than the CPU has, so a larger count would fail every start. Checked against the fingerprint's
    count (a real probe's) and the OS's, as loading checks it. Raises ValueError."""
    most = machine.get("threads")
    if not _whole(most, 1):
        return  # (a fingerprint without the count: `check_plan`'s bound still holds)
    most = min(most, os.cpu_count() or most)
    if plan["threads"] > most:
        raise ValueError(f"the plan's threads is {plan['threads']}, more than the {most} this machine has")


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
    check_measurements(data["measurements"])
    return Profile(**data)


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _one_of(value: Any, names: type[Strategy] | type[CachePolicy]) -> bool:
    return isinstance(value, str) and value in {n.value for n in names}


def _shown(value: Any) -> str:
    """A bad value for a notice, cut short: a file may hold a number of thousands of digits or a large object (JSON
    refuses integers of over 4300 digits, so `repr` takes any it gives)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


PLAN_FIELDS = {"threads", "accelerator", "strategy", "cache", "static_experts", "kernel", "quant", "static",
               "prefetch"}


def check_plan(plan: dict[str, Any]) -> None:
    """The plan as `Plan.to_dict` writes it (plus `static`, the experts kept on the accelerator)."""
    unknown = set(plan) - PLAN_FIELDS
    if unknown:
        raise ValueError(f"the plan has unknown fields {sorted(unknown)}")

    def bad(name: str, value: Any, what: str) -> ValueError:
        return ValueError(f"the plan's {name} is {_shown(value)}, not {what}")

    if not _whole(plan.get("threads"), 1) or plan["threads"] > MAX_COUNT:
        raise bad("threads", plan.get("threads"), f"a whole number from 1 to {MAX_COUNT}")
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
    ahead = plan.get("prefetch", {})
    if not isinstance(ahead, dict) or set(ahead) - {"predictor", "depth", "min_precision"}:
        raise bad("prefetch", ahead, "an object of predictor, depth and min_precision")
    if not (isinstance(ahead.get("predictor", "none"), str) and ahead.get("predictor", "none") in set(PredictorKind)):
        raise bad("prefetch predictor", ahead["predictor"], f"one of {', '.join(PredictorKind)}")
    if not _whole(ahead.get("depth", 0), 0) or ahead.get("depth", 0) > MAX_DEPTH:
        raise bad("prefetch depth", ahead["depth"], f"a whole number from 0 to {MAX_DEPTH}")
    if not _number(ahead.get("min_precision", 0), False) or ahead.get("min_precision", 0) > 1:
        raise bad("prefetch min_precision", ahead["min_precision"], "a number from 0 to 1")
    static = plan.get("static", [])
    if not isinstance(static, list) or not all(
            isinstance(k, list) and len(k) == 2 and all(_whole(v, 0) for v in k) for k in static):
        raise bad("static", static, "a list of [layer, expert] pairs")


MEASURED_MAX = 1e9  # a latency in ms, a rate in GB/s or GFLOPS: far beyond any machine, and finite in any sum
BYTES_MAX = 1 << 60  # an expert's bytes, the accelerator's: beyond any machine, and exact as a float's magnitude


def _number(value: Any, positive: bool) -> bool:
    """A number in range, compared before any conversion: NaN and infinities fail the comparison, and an integer too
    large for a float (JSON allows 10**400) is simply out of range. Either would turn the cost model's sums into NaN
    or raise in them."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0 < value <= MEASURED_MAX if positive else 0 <= value <= MEASURED_MAX)


def _count_key(key: Any) -> bool:
    """A count as a JSON key (a text of ASCII digits: "²" is a digit to `isdigit` but not to `int`), 1 to MAX_COUNT;
    its length bounded first (`int` refuses texts of over 4300 digits)."""
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6 and 1 <= int(key) <= MAX_COUNT


def _times(table: Any) -> bool:
    """An object of counts (threads or tokens) to times in ms."""
    return isinstance(table, dict) and all(_count_key(k) and _number(v, False) for k, v in table.items())


def check_measurements(m: dict[str, Any]) -> None:
    """The measurements as `Measurements.to_dict` writes them, or none (`{}`): the planner and the batch policy
    compute with them at every start, so a bad value would fail every start. Fields this Tandem does not read are
    let be, as `Measurements.from_dict` lets them be (fields are added without a new schema; missing optional ones
    read as none). Raises ValueError naming the first bad field."""
    if not m:
        return

    def bad(name: str, value: Any, what: str) -> ValueError:
        return ValueError(f"the measurements' {name} is {_shown(value)}, not {what}")

    if not _whole(m.get("cores"), 1) or m["cores"] > MAX_COUNT:
        raise bad("cores", m.get("cores"), f"a whole number from 1 to {MAX_COUNT}")
    if not _whole(m.get("expert_bytes"), 1) or m["expert_bytes"] > BYTES_MAX:
        raise bad("expert_bytes", m.get("expert_bytes"), f"a whole number from 1 to {BYTES_MAX}")
    cpu = m.get("cpu")  # (the planner takes the fastest of them: none is no measurement)
    if not isinstance(cpu, dict) or not cpu or not all(
            _count_key(t) and isinstance(f, dict) and _number(f.get("a_ms"), True) and _number(f.get("b_ms"), False)
            for t, f in cpu.items()):
        raise bad("cpu", cpu, "an object of thread counts, each with a_ms > 0 and b_ms ≥ 0")
    samples = m.get("cpu_samples") or {}
    if not isinstance(samples, dict) or not all(_count_key(t) and _times(s) for t, s in samples.items()):
        raise bad("cpu_samples", samples, "an object of thread counts, each of token counts and times")
    kernel = m.get("kernel") or {}
    if not isinstance(kernel, dict) or not _times(kernel.get("torch_ms") or {}):
        raise bad("kernel", kernel, "an object (its torch_ms: token counts and times)")
    if not isinstance(kernel.get("isa"), str | None):
        raise bad("kernel isa", kernel["isa"], "a name")
    if kernel.get("crossover") is not None and not _whole(kernel["crossover"], 1):
        raise bad("kernel crossover", kernel["crossover"], "a whole number ≥ 1")
    for name in ("dram_gbps", "h2d_gbps", "d2h_gbps", "gflops"):  # rates, divided by
        if m.get(name) is not None and not _number(m[name], True):
            raise bad(name, m[name], f"a number above 0, at most {MEASURED_MAX:g}")
    for name in ("gpu_expert_ms", "copy_expert_ms", "ship_ms", "token_overhead_ms"):
        if m.get(name) is not None and not _number(m[name], False):
            raise bad(name, m[name], f"a number from 0 to {MEASURED_MAX:g}")
    vram = m.get("vram_for_experts")
    if vram is not None and (not _whole(vram, 0) or vram > BYTES_MAX):
        raise bad("vram_for_experts", vram, f"a whole number from 0 to {BYTES_MAX}")
    if not isinstance(m.get("shared_device", False), bool | None):
        raise bad("shared_device", m["shared_device"], "true or false")
    recall = m.get("predictor_recall") or {}
    if not isinstance(recall, dict) or not all(
            k in set(PredictorKind) - {"none"} and isinstance(v, list) and 1 <= len(v) <= MAX_DEPTH
            and all(_number(x, False) and x <= 1 for x in v) for k, v in recall.items()):
        raise bad("predictor_recall", recall, f"an object of predictors, each a list of 1 to {MAX_DEPTH} recalls "
                  "from 0 to 1")
    try:  # as its readers take them: whatever passed the checks above must convert
        Measurements.from_dict(m)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"the measurements cannot be read ({e!r})") from None


def _set_aside(path: Path, why: str) -> str:
    try:
        aside = set_aside(path, ".json")
    except OSError:
        return f"the profile {path} is unusable ({why}) and could not be moved aside; run `tandem autotune`"
    return f"the profile {path.name} was set aside as {aside.name} because {why}; run `tandem autotune` to re-tune"
