"""Where Tandem keeps its files: the user's data and cache folders, or `$TANDEM_HOME` when set (tests)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem", appauthor=False))


def cache_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override) / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("tandem", appauthor=False))
