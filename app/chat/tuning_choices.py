"""What the user chose about tuning, saved as versioned JSON under the data folder: the models whose tuning they
skipped, each on one machine.

A skip is keyed by the same machine and model fingerprints as a tuning profile (`autotune.probe`'s
`fingerprint()`, `autotune.profile.model_fingerprint`), so the wizard is offered only for a model that is neither
tuned nor skipped on this machine; new hardware or another model (or dtype) is asked about again. It is not the
profile store (that is `autotune/profile.py`) and it never decides a setting. A file that cannot be used is set
aside with a notice and nothing counts as skipped: the worst case is the wizard offered once more.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.runtime.paths import atomic_write_json, data_dir, read_saved

SCHEMA = 1


def _key(fingerprint: dict[str, Any]) -> str:
    """A fingerprint compared as canonical JSON: read back from the file it equals the one just computed."""
    return json.dumps(fingerprint, sort_keys=True)


@dataclass(frozen=True)
class Skip:
    machine: dict[str, Any]  # the machine's fingerprint
    model: dict[str, Any]  # the model's fingerprint (model type, config digest, dtype)
    when: str = ""  # when it was skipped, for whoever reads the file

    def matches(self, machine: dict[str, Any], model: dict[str, Any]) -> bool:
        return _key(self.machine) == _key(machine) and _key(self.model) == _key(model)


@dataclass(frozen=True)
class TuningChoices:
    skipped: tuple[Skip, ...] = field(default_factory=tuple)

    def is_skipped(self, machine: dict[str, Any], model: dict[str, Any]) -> bool:
        return any(s.matches(machine, model) for s in self.skipped)

    def with_skip(self, machine: dict[str, Any], model: dict[str, Any]) -> TuningChoices:
        """These choices plus a skip of `model` on `machine` (unchanged if already skipped)."""
        if self.is_skipped(machine, model):
            return self
        return TuningChoices((*self.skipped, Skip(machine, model, time.strftime("%Y-%m-%dT%H:%M:%S"))))

    def merged(self, other: TuningChoices) -> TuningChoices:
        """These choices and those of `other` that these lack."""
        extra = tuple(s for s in other.skipped if not self.is_skipped(s.machine, s.model))
        return TuningChoices((*self.skipped, *extra))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA,
                "skipped": [{"machine": s.machine, "model": s.model, "when": s.when} for s in self.skipped]}


def choices_from_dict(data: Any) -> TuningChoices:
    """The choices read from the file; raises ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError("it is not a JSON object")
    if data.get("schema") != SCHEMA or isinstance(data.get("schema"), bool):
        raise ValueError(f"schema {data.get('schema')!r}, this Tandem reads {SCHEMA}")
    if set(data) - {"schema", "skipped"}:
        raise ValueError(f"unknown fields {sorted(set(data) - {'schema', 'skipped'})}")
    entries = data.get("skipped", [])
    if not isinstance(entries, list):
        raise ValueError(f"'skipped' is {entries!r}, not a list")
    skips = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"machine", "model", "when"}:
            raise ValueError(f"skip {i} is not an object of machine, model and when")
        machine, model, when = entry.get("machine"), entry.get("model"), entry.get("when", "")
        if not isinstance(machine, dict) or not isinstance(model, dict) or not isinstance(when, str):
            raise ValueError(f"skip {i}: machine and model must be JSON objects, when a text")
        skips.append(Skip(machine, model, when))
    return TuningChoices(tuple(skips))


def choices_path() -> Path:
    return data_dir() / "tuning-choices.json"


def load_tuning_choices() -> tuple[TuningChoices, str | None]:
    """The saved choices (none if no file) and a notice for the user when the file could not be used (it is set
    aside, and nothing counts as skipped)."""
    return read_saved(choices_path(), choices_from_dict, TuningChoices(), "tuning choices file",
                      "the tuning wizard may be offered again")


def save_skip(choices: TuningChoices) -> TuningChoices:
    """Save `choices` merged with what the file holds now (another window may have skipped another model
    meanwhile) and return what was saved. Raises OSError or StoreError when it cannot be written; a file that
    cannot be read is set aside first (see `load_tuning_choices`)."""
    saved, _ = load_tuning_choices()
    choices = saved.merged(choices)
    atomic_write_json(choices_path(), choices.to_dict())
    return choices
