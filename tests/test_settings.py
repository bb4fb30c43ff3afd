"""Settings: non-finite numbers and wrong types are refused, from the file (set aside) and from the form."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem.app.chat.settings import SCHEMA, Settings, load_settings, save_settings, settings_path
from tandem.kernels.errors import GenerationError, SettingsError
from tandem.runtime.sampling import SamplingParams

BAD_FILES = {
    "temperature NaN": '{"schema": 1, "temperature": NaN}',
    "temperature Infinity": '{"schema": 1, "temperature": Infinity}',
    "top_p -Infinity": '{"schema": 1, "top_p": -Infinity}',
    "repetition penalty NaN": '{"schema": 1, "repetition_penalty": NaN}',
    "top_k a text": '{"schema": 1, "top_k": "5"}',
    "top_k a float": '{"schema": 1, "top_k": 2.5}',
    "top_k a boolean": '{"schema": 1, "top_k": true}',
    "max_new_tokens negative": '{"schema": 1, "max_new_tokens": -3}',
    "max_new_tokens zero": '{"schema": 1, "max_new_tokens": 0}',
    "max_new_tokens a boolean": '{"schema": 1, "max_new_tokens": true}',
    "temperature a boolean": '{"schema": 1, "temperature": false}',
    "temperature a text": '{"schema": 1, "temperature": "hot"}',
    "system prompt a number": '{"schema": 1, "system_prompt": 7}',
    "system prompt null": '{"schema": 1, "system_prompt": null}',
    "unknown field": '{"schema": 1, "colour": "red"}',
    "not an object": '[1, 2]',
    "no schema": '{"temperature": 0.5}',
    "nested too deeply": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_settings_file_with_wrong_contents_is_set_aside(content: str) -> None:
    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    settings, notice = load_settings()
    assert settings == Settings() and notice is not None
    assert "set aside as settings.bad-" in notice and "defaults apply" in notice
    assert not path.exists() and len(list(path.parent.glob("settings.bad-*"))) == 1


def test_whole_numbers_in_float_fields_are_fine() -> None:
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text(json.dumps({"schema": SCHEMA, "temperature": 1, "top_p": 1}))
    settings, notice = load_settings()
    assert notice is None and settings.temperature == 1 and settings.params().top_p == 1


@pytest.mark.parametrize("field, text", [("temperature", "nan"), ("temperature", "inf"), ("top_p", "NaN"),
                                         ("repetition_penalty", "-inf"), ("temperature", "1e400"),
                                         ("top_p", "infinity")])
def test_the_form_refuses_non_finite_numbers(field: str, text: str) -> None:
    with pytest.raises(SettingsError, match="is not a finite number"):
        Settings.from_strings({field: text})


@pytest.mark.parametrize("field, text, message", [("top_k", "5.5", "not a whole number"),
                                                  ("max_new_tokens", "nan", "not a whole number"),
                                                  ("max_new_tokens", "-3", "≥ 0|at least 1"),
                                                  ("max_new_tokens", "0", "at least 1"),
                                                  ("temperature", "", "not a number")])
def test_the_form_refuses_wrong_values(field: str, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_strings({field: text})


def test_the_form_reads_good_values() -> None:
    s = Settings.from_strings({"temperature": " 0.7 ", "top_k": "40", "system_prompt": "  Be brief. "})
    assert s.temperature == 0.7 and s.top_k == 40 and s.system_prompt == "  Be brief. "


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sampling_params_refuse_non_finite_numbers(name: str, value: float) -> None:
    with pytest.raises(GenerationError, match=r"is not a finite number"):
        SamplingParams(**{name: value}).check()


def test_a_killed_settings_save_leaves_no_file_that_lasts(tandem_home: Path) -> None:
    import os
    import time

    save_settings(Settings(temperature=0.5))
    stale = tandem_home / ".settings-x1y2z3.json"
    stale.write_text("{")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = tandem_home / ".settings-a1b2c3.json"  # perhaps another window saving right now: left alone
    fresh.write_text("{")
    settings, notice = load_settings()
    assert settings.temperature == 0.5 and notice is None and not stale.exists() and fresh.exists()
